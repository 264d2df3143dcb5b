"""Analysis: what a recorded run means. Findings (diagnosis rules), run comparison and the pure data shaping
the pages show. Reads the store; imports no torch."""
