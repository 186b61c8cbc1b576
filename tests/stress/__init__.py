"""The stress harness and history checker (issue 6); see harness.py and checker.py."""
