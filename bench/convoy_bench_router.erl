%% The registered processes a bench router (`convoy_bench_ceiling',
%% `convoy_bench_handover') runs on each node of a measurement: started fresh
%% and stopped around it. Each role's init function takes the starter's pid and
%% answers `{started, node(), Name}' once registered.
-module(convoy_bench_router).

-export([start/3, stop/2]).

%% @doc Start `Module''s roles (`{RegisteredName, InitFunction}') on each of
%% `Nodes', replacing any left from an earlier measurement.
-spec start(module(), [node()], [{atom(), atom()}]) -> ok.
start(Module, Nodes, Roles) ->
    ok = stop(Nodes, [Name || {Name, _Init} <- Roles]),
    lists:foreach(
      fun(Node) ->
              [_ = spawn(Node, Module, Init, [self()]) || {_Name, Init} <- Roles],
              [receive {started, Node, Name} -> ok
               after 10000 -> exit({timeout, {Module, Node, Name}})
               end || {Name, _Init} <- Roles]
      end, lists:usort(Nodes)).

%% @doc Kill the processes registered as `Names' on each of `Nodes' and wait
%% until they are gone.
-spec stop([node()], [atom()]) -> ok.
stop(Nodes, Names) ->
    lists:foreach(fun(Node) -> [stop_one(Node, Name) || Name <- Names] end,
                  lists:usort(Nodes)).

stop_one(Node, Name) ->
    case erpc:call(Node, erlang, whereis, [Name]) of
        undefined ->
            ok;
        Pid ->
            Mon = monitor(process, Pid),
            exit(Pid, kill),
            receive {'DOWN', Mon, process, Pid, _} -> ok end
    end.
