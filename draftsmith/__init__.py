"""draftsmith: train, convert and serve speculative-decoding draft heads.

The import root holds the CLI, what every layer shares (`errors`, `corpus`) and `draftsmith.methods` (one
folder per speculation method, and their registry); the work lives in `draftsmith.models` (model code
shared by training and serving), `draftsmith.serve` (the engine), `draftsmith.train` and
`draftsmith.convert`.
"""

__version__ = "0.1.0"
