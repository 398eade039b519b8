from ._entry import full_cli

full_cli()
