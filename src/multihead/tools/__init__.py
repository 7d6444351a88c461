"""Tools around the layer: trace, cost, explain, models (the bundled MiniLM), bench, cli."""
