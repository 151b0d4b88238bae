"""`python -m server.chat --url http://host:port/v1`: see server/chat/cli.py."""
import sys

from server.chat.cli import main

sys.exit(main())
