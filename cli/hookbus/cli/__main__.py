from ._console_script import full_cli

full_cli()
