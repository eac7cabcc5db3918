%% @private
-module(convoy_app).
-behaviour(application).

-export([start/2, stop/1]).

%% @private
-spec start(application:start_type(), term()) -> {ok, pid()} | {error, term()}.
start(_Type, _Args) ->
    case convoy_config:from_env(application:get_all_env(convoy)) of
        {ok, Config} -> convoy_sup:start_link(Config);
        {error, Reason} -> {error, {convoy_config, Reason}}
    end.

%% @private
-spec stop(term()) -> ok.
stop(_State) ->
    ok.
