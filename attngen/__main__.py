from attngen.cli import main

main()
