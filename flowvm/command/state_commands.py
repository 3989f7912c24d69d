"""``resume`` and ``show`` for state checkpoints (``.safetensors``, flowvm.persist.state): the program built again
from the target and options the file records, the state loaded into it; shown without importing anything."""

from __future__ import annotations


from ..persist import state
from ..persist.formats import PICKLE, STATE
from .targets import build_program, recorded
from ..persist import checkpoint
from . import outputs
from .places import KEY_ENV, check_checkpoint_path, trusted_header
from .runs import check_model, check_output, finish, module_of, runner_for, saving_as_recorded, set_threads, write_model
from .values import printable, registers_summary
from ..base.errors import UsageError



def cmd_resume_state(args) -> int:
    """Build the program again (the recorded target and options, or --program; --set adds options) and
    load the saved state into it."""
    check_checkpoint_path(args.checkpoint)
    header, key = trusted_header(args, args.path)
    meta = dict(header.get("meta") or {})
    module, program = _rebuild(args, meta)
    set_threads(args.threads if args.threads is not None else meta.get("threads"))  # as the run had it
    meta = dict(saving_as_recorded(args, meta), every=args.every, every_seconds=args.every_seconds,
                show=list(getattr(module, "SHOW", meta.get("show", []))))
    classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    drv = STATE.load(args.path, program, key=key, restore_settings=not args.keep_settings,
                     classes=classes)  # the program module's own classes: results its run made
    if args.threads is not None:
        drv.resume_with(settings={"torch.threads": args.threads})
    ckpt = args.checkpoint if args.checkpoint is not None else args.path
    meta = outputs.resume(args, meta)  # --tensorboard, --output: where the run wrote, unless given anew
    check_output(args.output)
    check_model(module, args.output)
    status = runner_for(args, drv, meta, ckpt).run(args.max_steps)
    finish(drv, module, ckpt, key is not None, status)
    write_model(drv, module, args.output)
    return status


def _rebuild(args, meta: dict):
    """(module, program) built again from the target and options meta records (or --program, without them;
    --set adds options); meta updated to record what was built."""
    target = args.program or meta.get("target")
    if not target:
        raise UsageError(f"{args.path} does not record which program it ran; give it with --program TARGET")
    if args.program is not None:
        target = recorded(target)  # as run records it: found again from any directory
    sets = (list(meta.get("sets", [])) if args.program is None else []) + list(args.set)
    values = {"data": meta["data"]} if args.program is None and type(meta.get("data")) is str else {}
    meta.pop("data", None)
    module, program = build_program(target, sets, values)
    meta.update(target=target, module=module.__name__, sets=sets, **values)
    return module, program


def _title(path, header: dict, what: str) -> str:
    meta = header.get("meta") or {}
    data = f" --data {meta['data']}" if type(meta.get("data")) is str else ""
    run = f" {meta['target']}{data}" + "".join(f" --set {s}" for s in meta.get("sets", [])) + "," \
        if meta.get("target") else ""
    return (f"# {path}:{run} {what}written by flowvm {header.get('flowvm')} (Python {header.get('python')}) "
            f"at {header.get('created')}")


def cmd_show_state(args) -> int:
    """Print a state file's run: its saved listing with the position, and its registers; imports nothing."""
    _, key = trusted_header(args, args.path)
    header, listing, registers = state.show_state(args.path, key=key)
    print(printable(_title(args.path, header, "state checkpoint ")))
    print(printable(listing))
    print(printable(registers_summary(registers)))
    return 0


def cmd_show_checkpoint(args) -> int:
    """Print a pickle checkpoint's run.  Unsigned and without --trust: its header only, read without importing
    or unpickling anything (the modules loading it would import are listed); with its key (signed) or
    --trust: the run loaded, its listing with the position and its registers."""
    header, key = trusted_header(args, args.path)
    meta = header.get("meta") or {}
    print(printable(_title(args.path, header, "")))
    if key is None and not getattr(args, "trust", False):
        state_text = f"finished after {header.get('steps')} steps" if header.get("done") else \
            f"step {header.get('steps')}"
        print(printable(f"# flowvm driver: {state_text} of a {header.get('program')}"))
        settings = header.get("settings") or {}
        if settings:
            print(printable("settings: " + ", ".join(f"{n}={v!r}" for n, v in settings.items())))
        names = checkpoint.references(args.path)
        shown = ", ".join(f"{m}.{n}" for m, n in names[:_NAMES]) + (f", ... ({len(names)} in all)"
                                                                    if len(names) > _NAMES else "")
        print(printable(f"loading it imports and calls: {shown or 'nothing'}"))
        print("registers: not shown: the file is unsigned, and reading them runs code the file chooses; give "
              f"--trust if you trust its source, or its key (--key or ${KEY_ENV}) if it is signed")
        return 0
    module_of(meta)
    drv = PICKLE.load(args.path, key=key, restore_random=False)
    print(printable(str(drv)))  # the listing, headed by the step count and marked at the position
    print(printable(registers_summary(drv.registers)))
    return 0


_NAMES = 20  # names of what loading imports, listed by show
