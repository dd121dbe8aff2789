"""Stop strings matched as a sequence's text grows, at a cost per token that does not grow
with the stop strings' length.

Each step the engine must know whether the text now contains a stop string, and how much
of its end could still become one (that part is held back from the client). Searching the
whole stop string and testing each of its prefixes against the text's end costs the square
of its length per token: four 260,000-character stops once held the engine thread ~4 s a
token. Here each stop string keeps a Knuth-Morris-Pratt state (the longest of its prefixes
that the text ends with), advanced over the characters appended since the last step: the
work per token is the new characters times the number of stops (amortized), and building
the tables costs the stops' total length once per request.
"""

from __future__ import annotations


def _borders(s: str) -> list[int]:
    """borders[q]: the length of the longest proper prefix of s[:q] that is also its suffix."""
    borders = [0] * (len(s) + 1)
    k = 0
    for q in range(1, len(s)):
        while k and s[q] != s[k]:
            k = borders[k]
        if s[q] == s[k]:
            k += 1
        borders[q + 1] = k
    return borders


class StopMatcher:
    """Stop strings against one growing text (the detokenizer's, which only appends)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._borders = [_borders(s) for s in stops]
        self._matched = [0] * len(stops)  # per stop: the longest prefix of it the text ends with
        self._seen = 0  # characters of the text already fed

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over what `text` appended since the last call. Returns (start, stop) of the
        match that starts first (a tie goes to the smaller string), or None. A match wholly
        inside text fed earlier was returned then, so only matches ending in the new part count."""
        hits = []
        for i, stop in enumerate(self.stops):
            q, borders, n = self._matched[i], self._borders[i], len(stop)
            for pos in range(self._seen, len(text)):
                c = text[pos]
                while q and (q == n or stop[q] != c):
                    q = borders[q]
                if stop[q] == c:
                    q += 1
                    if q == n:
                        hits.append((pos + 1 - n, stop))
                        break
            self._matched[i] = q
        self._seen = len(text)
        return min(hits) if hits else None

    def holdback(self) -> int:
        """How many characters at the end of the text fed could still begin a stop string:
        the longest proper prefix of any stop that the text ends with."""
        return max(
            (q if q < len(stop) else borders[q] for q, stop, borders in zip(self._matched, self.stops, self._borders)),
            default=0,
        )
