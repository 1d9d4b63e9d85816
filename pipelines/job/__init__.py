"""The job: its typed config, the YAML schema it is checked against, and its fingerprint."""
