"""Head training: features from the trunk and the `train-head` recipe for MTP heads."""
