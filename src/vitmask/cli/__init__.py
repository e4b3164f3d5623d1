"""The command line: the process entry point (entry.py), the typer app that parses each verb's
options (commands.py), what each verb does with them (verbs.py; `vitmask finetune` in finetune.py, `vitmask predict` in
predict.py).

Nothing else in vitmask imports this package but vitmask demo's server (vitmask.demo), which opens
its models with `verbs.open_model`, as the verbs do.
"""
