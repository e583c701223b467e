"""The one exception type for mistakes a user can fix."""


class UserError(Exception):
    """A problem in the user's input: names the field (a dotted path) and the fix.

    The CLI prints it as one line and exits 1; anything else is a bug and keeps
    its stack trace.
    """

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.field}: {self.problem}" if self.field else self.problem
        return f"{text}; {self.fix}" if self.fix else text


class UserErrors(UserError):
    """Several independent problems found in one pass (each printed on its own line)."""

    def __init__(self, errors: list[UserError]):
        self.errors = errors
        Exception.__init__(self, "\n".join(str(e) for e in errors))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)
