import os

# The persistent cache of compiled packages (flowvm/fused/cache.py) is off for the tests, and for the programs
# they start, unless a test gives its own directory: a package cached by one test must not change what
# another sees, nor a run of the suite what the next one sees.
os.environ["FLOWVM_CACHE_DIR"] = "off"
