"""Reading the router's /metrics with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """Every sample of one /metrics text, looked up by name and (a subset of) labels."""

    def __init__(self, text: str):
        self.text = text
        self.samples: list[tuple[str, dict, float]] = []
        self.families: set[str] = set()
        for fam in text_string_to_metric_families(text):
            self.families.add(fam.name)
            for s in fam.samples:
                self.samples.append((s.name, dict(s.labels), s.value))

    def get(self, name: str, **labels) -> float:
        """The one sample with exactly these labels (0.0 when absent, like an untouched counter)."""
        found = [v for n, lab, v in self.samples if n == name and lab == labels]
        assert len(found) <= 1, (name, labels, found)
        return found[0] if found else 0.0

    def total(self, name: str, **labels) -> float:
        """Sum over the samples whose labels include these."""
        return sum(v for n, lab, v in self.samples if n == name and labels.items() <= lab.items())

    def series(self, name: str) -> list[dict]:
        return [lab for n, lab, _ in self.samples if n == name]

    def nonzero(self, name: str) -> dict:
        """{label tuple: value} of the samples of `name` that are not zero."""
        return {tuple(sorted(lab.items())): v for n, lab, v in self.samples if n == name and v}


async def scrape(client) -> Scrape:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return Scrape(r.text)
