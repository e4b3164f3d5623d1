"""The command line: the process entry point (entry.py), the typer app that parses each verb's
options (commands.py), and what each verb does with them (verbs.py).

Nothing else in vitmask imports this package.
"""
