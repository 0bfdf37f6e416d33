"""The contract between `draftsmith convert` and the methods that bring formats: the format registry
(`registry`: readers register sources, writers exporters), reading a source checkpoint (`checkpoint`),
the layer-config fields heads share (`layer_config`), and the speculators format the EAGLE family shares
(`speculators`). A method's `convert.py` registers with it; `draftsmith.convert` (the CLI and the native
format) reads from it."""
