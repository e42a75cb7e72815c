import sys

from .dist import main

sys.exit(main())
