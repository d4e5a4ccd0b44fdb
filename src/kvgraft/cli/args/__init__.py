"""Every subcommand's arguments, one module per command module of :mod:`kvgraft.cli.cmd` (the same names);
each subcommand is one ``add_<name>(sub)`` function that declares its parser and names the function that
runs it as ``"module:function"``. Light imports only: ``kvgraft --help`` imports every one of them."""
