"""Tools beside the core: step traces (:mod:`.trace` records, :mod:`.replay` replays), the step picture
(:mod:`.plot`), the command line (:mod:`.cli`). The core never imports them."""
