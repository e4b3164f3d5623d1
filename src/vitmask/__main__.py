from vitmask.entry import main

main()
