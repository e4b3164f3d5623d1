"""The command line: the process entry point (entry.py), the typer app that parses each verb's
options (commands.py), what each verb does with them (verbs.py; `vitmask finetune` in finetune.py).

Nothing else in vitmask imports this package.
"""
