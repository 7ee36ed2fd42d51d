"""How a setting is declared, parsed and loaded: ``option()`` fields and their checks, the one-line-error
parser, experiment files and the configs that ship inside the package."""
