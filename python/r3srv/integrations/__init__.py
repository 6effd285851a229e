"""RL frameworks' plug-in points, filled with r3srv (verl: `rollout.name=r3srv`)."""
