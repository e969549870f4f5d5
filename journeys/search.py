"""A short hyperparameter search on val (`train.search`), with Optuna.

Each trial trains the transformer with settings drawn from `train.search.space` (a run of
its own in MLflow, nested under the training run); the trial whose best epoch has the
highest `train.monitor` (val ROC AUC by default) is the one kept. A search is more
checkpoints to choose from, and it is judged like the choice of an epoch: every validated
epoch of every trial is a choice, so promotion cross-fits over all of them
(`journeys.promotion.cross_fitted_transformer`), and a trial that is lucky on one half of
val does not survive the other.

Optuna's TPE sampler, seeded with `train.seed`, draws the first trials at random
(`STARTUP_TRIALS`) and later ones near the best so far: those later proposals read the
val figures of the trials before them, so in a long search the transformer's val figure
leans a little optimistic. The test split never takes part. `train.search.timeout` is
checked between trials: the trial running when it passes finishes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from journeys.config import SearchRange, with_settings
from journeys.errors import ConfigError

if TYPE_CHECKING:
    import optuna

    from journeys.config import Config

# Trials drawn at random before TPE models the results (Optuna's own default): a short
# search of this many or fewer is a seeded random search.
STARTUP_TRIALS = 10

# One trial: its configuration, the settings drawn and its number in; its best
# `train.monitor` (val ROC AUC by default) out.
TrialRun = Callable[["Config", dict[str, Any], int], float]


def drawn_settings(trial: optuna.Trial, config: Config) -> dict[str, Any]:
    """One trial's settings, `section.key -> value`, drawn from `train.search.space`: a
    list is choices, a range of an integer setting gives integers."""
    values: dict[str, Any] = {}
    for key, spec in config.train.search.space.items():
        if isinstance(spec, SearchRange):
            section, _, name = key.partition(".")
            current = getattr(getattr(config, section), name)
            if isinstance(current, int) and not isinstance(current, bool):
                low, high = math.ceil(spec.low), math.floor(spec.high)
                values[key] = trial.suggest_int(key, low, high, log=spec.log)
            else:
                values[key] = trial.suggest_float(key, spec.low, spec.high, log=spec.log)
        else:
            values[key] = trial.suggest_categorical(key, spec)
    return values


def shown(settings: dict[str, Any]) -> str:
    """`key=value, ...`, numbers to four significant digits."""
    return ", ".join(
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in settings.items()
    )


def search(config: Config, run_trial: TrialRun) -> optuna.Study:
    """Run `train.search.trials` trials (fewer if `train.search.timeout` passes first),
    each `run_trial(trial_config, settings, number)` (numbered from 1), maximising the
    best `train.monitor` it returns. A trial whose drawn settings do not make a valid
    configuration together (a width inside a range that the heads do not divide) is
    skipped, pruned in Optuna's terms, and trains nothing."""
    import optuna

    settings = config.train.search
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line a trial, ours
    sampler = optuna.samplers.TPESampler(seed=config.train.seed, n_startup_trials=STARTUP_TRIALS)
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def objective(trial: optuna.Trial) -> float:
        number, values = trial.number + 1, drawn_settings(trial, config)
        try:
            trial_config = with_settings(config, values)
        except ConfigError as err:
            print(f"search trial {number} of {settings.trials}: skipped, {shown(values)}: {err}")
            raise optuna.TrialPruned(str(err)) from None
        print(f"search trial {number} of {settings.trials}: {shown(values)}", flush=True)
        score = run_trial(trial_config, values, number)
        best = max([score, *(t.value for t in study.trials if t.value is not None)])
        print(f"search trial {number}: {config.train.monitor} {score:.4f} (best {best:.4f})")
        return score

    study.optimize(objective, n_trials=settings.trials, timeout=settings.timeout)
    return study
