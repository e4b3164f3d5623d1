"""The command line: the process entry point (entry.py), the typer app that parses each verb's
options (commands.py), what each verb does with them (verbs.py; train and finetune call train/run.py;
`vitmask predict` is in predict.py, `vitmask sweep`'s checks of its options in sweep.py).

Nothing in vitmask imports this package but `vitmask.__main__` (scripts/check_imports.py refuses any
other importer): what the verbs share with other packages lives below, e.g. opening a model by name
or path in inference/open.py, which vitmask demo's server uses too.
"""
