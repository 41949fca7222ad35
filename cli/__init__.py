"""The `tandem` command: one module per subcommand, registered in cli/main.py."""
