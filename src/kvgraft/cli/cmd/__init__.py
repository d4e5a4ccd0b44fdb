"""One module per family of ``kvgraft`` subcommands. Each function takes the parsed arguments, calls one
entry-point function of the library and prints its result; no logic of its own. ``kvgraft.cli.main`` imports
the module of the command being run only, so ``kvgraft --help`` never loads torch or transformers."""
