"""`accelerate launch -m draftsmith.train RECIPE.yaml [section.key=value ...]`"""

import sys

from draftsmith.train.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
