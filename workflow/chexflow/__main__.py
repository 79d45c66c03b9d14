from chexflow.cli import main

main()
