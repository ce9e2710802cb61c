"""One file per registered analysis (`@register_analysis`); `kvlens.analysis.registry` imports them all."""
