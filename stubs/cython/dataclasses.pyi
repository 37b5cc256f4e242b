from dataclasses import dataclass as dataclass, field as field
