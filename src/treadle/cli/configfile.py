"""The YAML of a config file, read strictly: what ``treadle train`` (``cli.load_config``) parses a config and each
``--key value`` override with.

- YAML 1.2 scalars: only true/false are booleans (``eval_strategy: no`` stays the string "no"), and ``1e-3`` is a
  float (YAML 1.1 wants ``1.0e-3``);
- a key written twice in one mapping is refused by name (PyYAML keeps the last silently: two ``learning_rate``
  keys trained at the second one without a word); ``<<`` merge keys still override what they merge, as YAML says;
- aliases are bounded: a document whose values, with every alias expanded, number more than ``MOST_VALUES`` is
  refused (a 1 KB "billion laughs" alias bomb expands to megabytes the moment a value is printed or used as a path).

Both refusals are ``yaml.constructor.ConstructorError``\\ s with a line, which ``load_config`` prints as one line.
"""

from __future__ import annotations

import re

import yaml
from yaml.constructor import ConstructorError

MOST_VALUES = 100_000  # values a config may hold once its aliases are expanded (a real one holds under 1,000)

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_FLOAT = re.compile(
    r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$"
    r"|^\.(?:nan|NaN|NAN)$"
)


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 scalars, duplicate keys refused and aliases bounded (module docstring)."""

    def construct_document(self, node):
        expanded = expanded_size(node, MOST_VALUES)
        if expanded > MOST_VALUES:
            raise ConstructorError(
                None,
                None,
                f"its aliases (*name) expand to more than {MOST_VALUES:,} values (an alias bomb?); write "
                f"the values out, or use fewer aliases",
                node.start_mark,
            )
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                if key_node.value in seen:
                    raise ConstructorError(
                        None,
                        None,
                        f"duplicate key {key_node.value!r} (also at line {seen[key_node.value] + 1}): a "
                        f"mapping holds each key once; keep the one you mean",
                        key_node.start_mark,
                    )
                seen[key_node.value] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


StrictLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def expanded_size(node, most: int) -> int:
    """How many values ``node`` holds with every alias expanded (an alias is the very node object it names, so
    a shared node counts once per use); counting stops soon after ``most``. Linear in the distinct nodes."""
    sizes: dict[int, int] = {}

    def size(n) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        sizes[id(n)] = most + 1  # a node that holds itself (a recursive alias) is unbounded
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [child for pair in n.value for child in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > most:
                break
        sizes[id(n)] = min(total, most + 1)
        return sizes[id(n)]

    return size(node)


def load(text_or_file):
    """The YAML document in ``text_or_file`` read with :class:`StrictLoader`."""
    return yaml.load(text_or_file, Loader=StrictLoader)
