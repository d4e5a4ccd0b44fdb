"""Exit statuses of the ``kvgraft`` command (besides 0)."""

EXIT_ERROR = 2  # bad arguments, missing or corrupt files, out-of-range values: one line on stderr
EXIT_BLOCKED = 3  # kvgraft doctor: the report lists at least one blocker
