"""Tools beside the core: step traces (:mod:`.trace`), the step picture (:mod:`.plot`), the command line
(:mod:`.cli`)."""
