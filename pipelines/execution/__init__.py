"""Running a job: row order, the local executor and the Ray executor."""
