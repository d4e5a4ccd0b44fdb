"""Exit statuses of the ``kvgraft`` command (besides 0)."""

EXIT_BUG = 1  # an exception that is not a user error: a bug in kvgraft, printed with its traceback
EXIT_ERROR = 2  # bad arguments, missing or corrupt files, out-of-range values: one line on stderr
EXIT_BLOCKED = 3  # kvgraft doctor: the report lists at least one blocker
EXIT_EXPORT_ERROR = 4  # kvgraft convert: the stock export measured above its tolerance; nothing written
EXIT_INTERRUPTED = 130  # a long job stopped by a signal after its checkpoint: rerun the command to continue
