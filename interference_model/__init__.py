"""interference_model."""
