"""The Django project. Importing it loads the Celery app so `@shared_task` binds to it."""
from config.celery import app as celery_app

# The platform's release: GET /version and the OpenAPI schema's info.version.
__version__ = "1.1.0"

__all__ = ["__version__", "celery_app"]
