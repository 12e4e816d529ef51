"""The documentation site: its generated references, their generators and the site's checks."""
