from vitmask.cli import main

main()
