"""The two ways a job can fail, mapped one-to-one onto the CLI's exit codes.

`JobError` means the job itself is wrong or a resume is refused: nothing ran (exit 2).
`RunError` means a valid job broke while running (exit 1); committed shards stay valid.
Problems with a single input row are neither: they become error rows and the job goes on.
"""


class JobError(Exception):
    """Invalid job file, unreadable input, or a refused resume (exit code 2)."""

    exit_code = 2


class RunError(Exception):
    """The run started but could not finish (exit code 1)."""

    exit_code = 1
