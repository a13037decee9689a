"""Per-connection guards every front end that takes audio applies: the flood guard and the idle timeout."""
