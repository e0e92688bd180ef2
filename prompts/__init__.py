"""The prompt texts (*.txt): this folder ships as the package `sinkchat.prompts` (see pyproject.toml); read them with
`sinkchat.bootstrap.read_prompt(name)`."""
