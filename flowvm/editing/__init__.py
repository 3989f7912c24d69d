"""The editing layer: matching parts of a program (match), rewriting them (edit), editing a half-run driver
(hotpatch) and register namespaces (isolate, template)."""
