"""Numbers as operators read them: `abbrev` (1.2M, 1T) where a table has little room, with
`grouped` (1,234,567) in the element's title for the exact figure. The same rules as
`abbrev` in static/console/charts.js, so a figure reads alike in a page and its charts."""
from django import template
from django.utils.html import format_html

register = template.Library()

UNITS = ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k"))


@register.filter
def abbrev(value) -> str:
    if value is None or value == "":
        return "–"
    number = float(value)
    for size, suffix in UNITS:
        if abs(number) >= size * 0.9995:  # so 999,999 reads 1M, not 1000k
            scaled = number / size
            text = f"{scaled:.1f}" if abs(scaled) < 10 else f"{scaled:.0f}"
            return text.removesuffix(".0") + suffix
    return str(int(number)) if number == int(number) else f"{number:.1f}"


@register.filter
def grouped(value) -> str:
    return "–" if value is None or value == "" else f"{int(value):,}"


@register.simple_tag
def amount(value, unit: str = ""):
    """<span title="1,000,000,000,000 tokens">1T</span>: short on the page, exact on hover."""
    return format_html('<span title="{} {}" data-value="{}">{}</span>', grouped(value), unit, value if value is not None else "",
                       abbrev(value))


@register.filter
def timestamp_age(epoch_s, now) -> str:
    """How long ago a Unix time was, to the second: "12 s", "3 min 4 s"."""
    seconds = max(0, round(now.timestamp() - float(epoch_s)))
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"
