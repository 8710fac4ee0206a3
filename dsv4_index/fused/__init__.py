"""The fused step build: task descriptors (:mod:`.tasks`), the one kernel (:mod:`.kernel`) and its
host plan (:mod:`.plan`)."""
