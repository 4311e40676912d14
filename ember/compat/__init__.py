"""The renaming layers: what a Lightning or Accelerate user imports, under ember's names,
over ember's own modules (see docs/architecture.md, "The packages and their arrows")."""
