"""The read deadlines and the idle close are checked at startup (inference.checks): Twisted's
idle clock also runs while a request is read, so set at or below a read deadline it would close
a slow request without the 408 that says why."""
from django.test import override_settings

from inference.checks import check_connection_deadlines


def test_an_idle_close_at_or_below_a_read_deadline_fails_the_system_check():
    assert check_connection_deadlines() == []
    with override_settings(HTTP_KEEPALIVE_TIMEOUT_S=30, REQUEST_HEAD_TIMEOUT_S=30, REQUEST_BODY_IDLE_S=20):
        errors = check_connection_deadlines()
        assert [e.id for e in errors] == ["inference.E012"]
        assert "REQUEST_HEAD_TIMEOUT_S" in errors[0].msg and "HTTP_KEEPALIVE_TIMEOUT_S" in errors[0].msg
    with override_settings(HTTP_KEEPALIVE_TIMEOUT_S=0, REQUEST_HEAD_TIMEOUT_S=30):  # 0: never closed idle
        assert check_connection_deadlines() == []
    with override_settings(REQUEST_BODY_IDLE_S=-1):
        assert "REQUEST_BODY_IDLE_S must not be negative" in check_connection_deadlines()[0].msg
