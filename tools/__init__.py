"""Tools beside the serving processes: training, load generation, eval, replay, the fleet."""
