"""Optional parts of distlock, each an app of its own that the core never imports."""
