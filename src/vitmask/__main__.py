from vitmask.cli.entry import main

main()
