"""One module per CLI verb (see ``streamrl.cli``)."""
