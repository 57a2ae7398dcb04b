"""The packaged Hydra configs stay on the search path whatever the primary config folder is.

``python -m train`` reads its configs from the installed ``recipes.conf`` package. A user who
points ``--config-path`` at a folder of their own gets that folder first, so a config there with a
packaged name wins, and the packaged configs after it (the model presets, the launcher presets,
the defaults a user config lists); ``--config-dir DIR`` adds a folder after the packaged ones.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from contract.configs import PACKAGED_CONFIGS


class PackagedConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="orchestrator", path=PACKAGED_CONFIGS)
