"""`exo-split bench`: run.py (the driver of the whole benchmark), lab.py (two network
namespaces, the nodes and the tbf-shaped link), driver.py (what runs inside them),
figures.py (the figures and the card), netns.py (the namespace helpers, also used by tests)."""
